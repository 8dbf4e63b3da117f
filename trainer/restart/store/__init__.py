"""`checkpoint.remote`, the store: its transport, what its errors mean, the verification of what it returns,
its lifecycle (commit, clean, prune, retire), the rule that nothing paid for is deleted (`safety`), fencing
by generation (`generations`) and conditional writes proven by a probe (`conditional`)."""
