"""Teachers: colocated (in the student's step) and disaggregated (streamed hidden states),
both behind the `Teacher` protocol (`hldstudy.teacher.base`)."""

from hldstudy.teacher.base import NO_FEED, StageFeed, Teacher
from hldstudy.teacher.colocated import ColocatedTeacher
from hldstudy.teacher.load import load_teacher, with_teacher_tokenizer

__all__ = ["NO_FEED", "ColocatedTeacher", "StageFeed", "Teacher", "load_teacher",
           "with_teacher_tokenizer"]
