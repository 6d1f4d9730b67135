"""The commands: their cache flags (flags), tq-generate (generate) and tq-server (server)."""
