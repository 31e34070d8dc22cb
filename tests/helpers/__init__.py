"""Test doubles (imported by tests as `helpers.*`; tests/ is on sys.path under pytest)."""
