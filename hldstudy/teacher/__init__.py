"""Teachers: colocated (in the student's step) and disaggregated (streamed hidden states)."""

from hldstudy.teacher.colocated import ColocatedTeacher, load_teacher, with_teacher_tokenizer

__all__ = ["ColocatedTeacher", "load_teacher", "with_teacher_tokenizer"]
