"""The local stack: Redis, the router and N replica workers on one machine."""
