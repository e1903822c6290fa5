"""Tests of the client commands of ``static`` (static/_commands), run as subprocesses."""
