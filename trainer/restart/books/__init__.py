"""The run's books: one ledger row per paid attempt, the heartbeat that books a killed one (`ledger`), the
records of earlier lease holders carried until booked (`handover`), and the clocks they are kept on (`clock`)."""
