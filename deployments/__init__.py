"""Ray Serve deployment of specserve: app builder, router ingress, lanes, worker actors."""
