"""Errors a user can cause: the CLI prints them as one line and exits with the error's code, never a
traceback. Codes: 2 bad input or a refused command; 3 this worker lost a stream's lease to another
(do not retry: someone else writes it now); 75 (EX_TEMPFAIL) a transient condition outlasted its budget
(storage unreachable, or full: harvest.storage's StorageFull), or a SIGTERM stop: rerunning the same command
later resumes, and a fleet's job recovery does (harvest.fleet.plan's RETRYABLE_EXIT_CODES)."""


class UserError(Exception):
    """Bad input (config, checkpoint, flag, mesh): the message names the input and what to do."""

    exit_code = 2


class FencedOut(UserError):
    """Another worker holds a stream this worker was writing: it stopped writing at once."""

    exit_code = 3


class RetryLater(UserError):
    """A transient failure lasted too long to wait out (e.g. storage unreachable past half the lease TTL)."""

    exit_code = 75
