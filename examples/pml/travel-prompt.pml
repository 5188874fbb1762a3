<!-- A prompt: imports modules from the schema, supplies arguments, adds new text. -->
<prompt schema="travel">
  <trip-plan duration="three days"><paris/></trip-plan>
  <budget/>
  <user>What should I see on the first day?</user>
  <assistant>
</prompt>
