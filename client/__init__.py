"""A small gRPC client of the router's Generation API (CLI: python -m client)."""
