"""The one "is W&B online?" check (sweep W&B executor, analysis W&B report)."""

import sys
import types

from hldstudy.wandb_online import wandb_online


def test_wandb_online(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", " Offline")
    assert wandb_online() == (False, "WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_online()[0]
    monkeypatch.delenv("WANDB_API_KEY")
    fake = types.SimpleNamespace(api=types.SimpleNamespace(api_key=None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ok, why = wandb_online()
    assert not ok and "wandb login" in why
    fake.api.api_key = "k"
    assert wandb_online() == (True, "logged in")
