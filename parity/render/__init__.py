"""Rendering: figures, the report page and the attribution section, from data alone, so a stored
report renders without torch exactly like a fresh one (`report_html(report)`).
"""

from parity.render.report_page import report_html

__all__ = ["report_html"]
