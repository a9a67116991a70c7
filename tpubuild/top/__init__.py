"""TOP-level passes and inference: canonicalize, reference inference."""
