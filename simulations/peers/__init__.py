"""Peer routers' published policies (ANCHORS.md), re-implemented faithfully over the
router's own view types so they run in the same simulation as `ramjet.policy` objects.
Round robin, least loaded and session consistent hashing are the router's own
baselines (`ramjet.policy.baselines`) and are not re-implemented here."""
