"""Load generation and the straggler study: Locust users, engine/HTTP sweeps, a one-lane simulator."""
