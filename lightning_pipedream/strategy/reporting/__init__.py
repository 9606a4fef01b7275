"""What ranks tell each other about a step (the last stage's summary, the user's logged values, the data check's
fingerprints); imports no other room of strategy/."""
