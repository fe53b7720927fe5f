"""The phase flip (docs/design.md): seam, census, warm-up ledger, policy and weight strategies.

It talks to the engine through `flip/host.py` (`LayoutHost`, `FlipObserver`) and imports
nothing from `engine/`.
"""
