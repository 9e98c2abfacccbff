"""Fleet-wide refit orchestration, shared by the operator and `tandem refit`: torch-free.

`transaction` holds the record and the pure rules (each engine's next step, waves, when
it is over); `orchestrator` takes the steps through the engines' admin API (`admin`).
"""

from tandem_engine.fleet.admin import AdminError, FleetAdmin
from tandem_engine.fleet.orchestrator import Event, advance, new_transaction, observe, run
from tandem_engine.fleet.transaction import (
    Act,
    EngineObs,
    EngineRecord,
    Failure,
    Phase,
    Transaction,
    Weights,
    choose_wave,
    next_act,
)

__all__ = ["Act", "AdminError", "EngineObs", "EngineRecord", "Event", "Failure",
           "FleetAdmin", "Phase", "Transaction", "Weights", "advance", "choose_wave",
           "new_transaction", "next_act", "observe", "run"]
