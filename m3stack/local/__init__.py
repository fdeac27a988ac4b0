"""The local stack (`m3stack up`): engines and a gateway as processes on loopback."""
