"""Test-only hub servers: a real olah mirror (downloads) and the project's own fake upload hub."""
