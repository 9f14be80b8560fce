"""Running a verb: the wiring from a validated config to Lightning's pieces (``wiring``), what
each verb does (``verbs``), memory-check as a mode of a run (``memory_check``) and the
seconds-long checks before a launch (``preflight``)."""
