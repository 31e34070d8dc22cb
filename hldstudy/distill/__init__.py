"""Distillation methods as strategy objects driving one shared trainer."""

from hldstudy.distill.base import Stage, Strategy, TeacherOutputs
from hldstudy.distill.baseline import Baseline
from hldstudy.distill.hld import HLDC, HLDF, Patient
from hldstudy.distill.kd import LogitKD

STRATEGIES: dict[str, type[Strategy]] = {
    "baseline": Baseline, "kd": LogitKD, "hldf": HLDF, "hldc": HLDC, "patient": Patient,
}


def make_strategy(cfg, student_cfg, teacher_cfg=None) -> Strategy:
    return STRATEGIES[cfg.distill.method](cfg, student_cfg, teacher_cfg)


__all__ = ["STRATEGIES", "Stage", "Strategy", "TeacherOutputs", "make_strategy"]
