"""The engine's flip observer: the policy's feeds and the ledger, on the `FlipObserver` hooks.

Made only when flips are on (law 11: with them off the engine has no observer and its loop is
unchanged). The policy (`flip/policy.py`) is fed every step and seam and, under
`--flip-policy auto`, asked between steps; the ledger (`flip/ledger.py`) measures what each
flip costs after its cutover.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from phaseflip.flip.census import layout_name
from phaseflip.flip.ledger import FlipLedger
from phaseflip.flip.policy import FlipPolicy, ResidencyPricer
from phaseflip.flip.seam import check_target


class FlipTelemetry:
    def __init__(self, policy: FlipPolicy, ledger: FlipLedger) -> None:
        self.policy, self.ledger = policy, ledger

    @classmethod
    def create(cls, cfg: Any, model_cfg: Any, hicache: Any) -> FlipTelemetry:
        """For an engine starting in `cfg`'s layout. Under --flip-policy auto the other
        layout must suit the model: refused now, as a flip to it would be."""
        from phaseflip.cache.hicache import page_keys

        if cfg.flip_policy == "auto":
            for layout in cfg.flip_layout_pair:
                if layout != (cfg.tp_size, cfg.pp_size):
                    check_target(cfg, model_cfg, *layout)
        hc = hicache
        pricer = ResidencyPricer(hc.page_size, lambda ids: page_keys(ids, hc.page_size,
                                                                     hc.fingerprint),
                                 hc.host.contains)
        policy = FlipPolicy(cfg, pricer)  # C includes each flip's refill, from the ledger
        return cls(policy, FlipLedger(layout_name(cfg.tp_size, cfg.pp_size),
                                      on_refill=policy.observe_refill))

    def on_items(self, items: Iterable[Any]) -> None:
        self.ledger.observe_items(list(items))

    def on_step(self, layout: tuple[int, int], prompt_tokens: int, decode_tokens: int,
                seconds: float, decode_groups: int = 1) -> None:
        self.policy.observe_step(layout, prompt_tokens, decode_tokens, seconds, decode_groups)
        self.ledger.observe_step(prompt_tokens + decode_tokens > 0, seconds)

    def before_seam(self, running: Iterable[Any]) -> None:
        self.ledger.before_seam(running)

    def on_seam(self, source: tuple[int, int], target: tuple[int, int], census: Any) -> None:
        self.policy.observe_flip(source, target, census.total_s)

    def on_cutover(self, census: Any, hicache: Any) -> None:
        self.ledger.cutover(census, hicache)
