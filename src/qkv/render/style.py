"""The look shared by qkv's full pages (the explore page and the live learning page): the
pressed toggle, the formula and note boxes, and the cells of number tables. Each page adds its
own rules after these.
"""

from __future__ import annotations

__all__ = ["PAGE_CSS"]

PAGE_CSS = """
.toggle button[aria-pressed="true"] { background: #08306b; color: #fff; border-color: #08306b; }
p.formula { font-family: ui-monospace, "DejaVu Sans Mono", monospace; background: #f6f8fa;
  padding: 4px 8px; }
p.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 4px 8px; }
p.note:empty { display: none; }
th, td { border: 1px solid #d0d7de; padding: 2px 7px; }
td.num { text-align: right; font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
"""
