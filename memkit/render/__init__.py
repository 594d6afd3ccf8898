"""Renderings of result objects: text tables, JSON, self-contained HTML. No torch at import."""
