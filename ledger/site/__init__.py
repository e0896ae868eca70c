"""Rendering the ledger into a static site (HTML, Markdown, vram.json, plots)."""
