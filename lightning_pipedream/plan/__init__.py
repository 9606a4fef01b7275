"""What runs where: profiles, topologies, partitioners and the Plan they produce."""
