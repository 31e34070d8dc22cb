"""The top floor: command-line programs whose code imports from several floors below
(the planner's CLI reads sweeps and compiles with `aot`; the FLOP CLI compiles the
trainer's step). `hldstudy <command>` dispatches here (`hldstudy.cli`)."""
