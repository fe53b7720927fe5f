"""Multi-process serving: ranks, their groups, the plan broadcast and stage-to-stage transfer."""
