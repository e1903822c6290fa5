"""The SQL migrations, one file per step and dialect, as package data (read by `_migrations`)."""
