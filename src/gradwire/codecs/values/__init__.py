"""Value codecs: one module per codec; each registers itself on import."""
