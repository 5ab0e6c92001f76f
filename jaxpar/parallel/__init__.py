"""How work is split over devices: the mesh and its axis roles, every sharding decision, and the collectives."""
