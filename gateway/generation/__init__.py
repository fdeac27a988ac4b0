"""From token ids to text deltas: open engine streams (routing, retries), decode what they send."""
