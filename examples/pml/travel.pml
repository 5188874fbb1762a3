<!-- A schema: everything that may be reused, encoded once and cached. -->
<schema name="travel">
  <system>You are a friendly travel agent. Answer in two or three sentences.</system>
  <module name="trip-plan">Plan a trip lasting <param name="duration" len="6"/> for a traveller who enjoys food, museums and long walks.
    <union>
      <module name="tokyo">Tokyo is Japan's capital. Highlights: the Senso-ji temple in Asakusa, the fish market at Toyosu, the gardens of Shinjuku Gyoen, and day trips to Nikko or Kamakura. The subway is fast and clean; a Suica card pays for trains and shops.</module>
      <module name="paris">Paris is France's capital. Highlights: the Louvre and the Musee d'Orsay, walks along the Seine, the market streets of the Marais, and a day trip to Versailles. The metro reaches everything; museums close one day a week.</module>
    </union>
  </module>
  <module name="budget">The traveller has a tight budget: prefer free sights, street food and public transport.</module>
</schema>
