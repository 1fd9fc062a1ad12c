"""The device side: talks to a verify server, drafts with a local drafter, commits verdicts."""
