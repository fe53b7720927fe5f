"""The phase flip (MISSION C6): seam, census, warm-up ledger, policy and weight strategies.

It talks to the engine through `flip/host.py` (`LayoutHost`, `FlipObserver`) and imports
nothing from `engine/`.
"""
