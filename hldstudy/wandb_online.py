"""Whether W&B is online: the one check shared by the sweep's W&B executor and the
analysis's W&B report (each says why it skips W&B when it is not)."""

from __future__ import annotations

import os

OFFLINE_MODES = ("offline", "disabled", "dryrun")


def wandb_online() -> tuple[bool, str]:
    """(online?, reason). Online needs WANDB_MODE not offline/disabled and an API key
    ($WANDB_API_KEY or `wandb login`)."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in OFFLINE_MODES:
        return False, f"WANDB_MODE={mode}"
    if os.environ.get("WANDB_API_KEY"):
        return True, "WANDB_API_KEY set"
    try:
        import wandb  # optional at run time: only W&B paths need it

        if getattr(wandb.api, "api_key", None):
            return True, "logged in"
    except Exception as e:  # noqa: BLE001 - wandb missing or not configured
        return False, f"wandb unavailable ({type(e).__name__}: {e})"
    return False, "no W&B API key (set WANDB_API_KEY or run `wandb login`)"
