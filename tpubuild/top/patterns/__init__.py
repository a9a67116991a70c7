"""TOP rewrite patterns, one module per family; canonicalize.py groups them into passes."""
