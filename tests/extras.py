"""Markers for tests that need an optional extra: without it they skip and say how to add it."""

from __future__ import annotations

import importlib.util

import pytest

needs_plots = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="needs the bench extra's matplotlib: pip install 'promptlang[bench]'")
