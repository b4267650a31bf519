"""Quadriga router: client API, replica registry, global scheduling over a Redis queue."""
