"""The shared verification server: sessions, scheduler, batched target forward, acceptance math."""
