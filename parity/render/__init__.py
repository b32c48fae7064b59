"""Rendering: figures, the report page and the attribution section, from data alone.

`figures` (matplotlib primitives and the drift figures), `report_page` (one report's HTML page
and the tables the nightly pages reuse) and `attribution` (attribution tables and charts) read
plain arrays and the JSON sections of a report, never an engine: a stored report renders
without torch, exactly like a fresh one. `report_html(report)` is one report's page.
"""

from parity.render.report_page import report_html

__all__ = ["report_html"]
