"""What every room that communicates shares: the collectives under the names this torch
has, and counting the bytes they send (one protocol, ``take_sent``). Imports only torch."""
