"""Who may write a run: the kernel lock on its directory (`lock`), the lease in its store (`lease`,
`lease_object`), a holder cut off and back (`reclaim`), and `train` holding both for its life (`owner`)."""
