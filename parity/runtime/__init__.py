"""The processes parity starts and their logs: the guard that kills children with parity, the process
helpers, and the quiet switch for engine logging."""
