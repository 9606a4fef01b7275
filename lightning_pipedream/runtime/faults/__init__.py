"""What ends a run: errors passed between ranks, the flight recorder and watchdog, mailboxes, and the launcher."""
