"""The site's jinja2 templates and static CSS/JS (installed from a wheel as vram_ledger_templates)."""
