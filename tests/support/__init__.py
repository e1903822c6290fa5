"""Test support: real server processes and a throwaway PostgreSQL cluster."""
