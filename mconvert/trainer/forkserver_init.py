"""Preloaded by multiprocessing's forkserver (train._start_method): the forkserver dies with the launcher that
started it, and the ranks it forked die with it (each arms its own parent-death signal in procs.run_rank).

Without this the forkserver outlives a SIGKILLed launcher: every rank holds the pipe whose EOF would stop it.
"""

from mconvert.trainer.procs import guard_forkserver

guard_forkserver()
