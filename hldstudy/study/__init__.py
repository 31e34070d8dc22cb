"""The studies: whole pipelines (corpus, teacher, phases, analysis) behind one command."""
