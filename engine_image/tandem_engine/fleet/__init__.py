"""Fleet-wide refit orchestration, shared by the operator and `tandem refit`: torch-free.

`transaction` holds the record and the pure rules (each engine's next step, waves, when
it is over); `orchestrator` takes the steps through the engines' admin API (`admin`).
"""

from tandem_engine.fleet.admin import AdminError, DrainResult, EngineAdmin, admin_url
from tandem_engine.fleet.orchestrator import Event, advance, new_transaction, observe, run
from tandem_engine.fleet.transaction import (
    Act,
    EngineObs,
    EngineRecord,
    Failure,
    Phase,
    Transaction,
    choose_wave,
    next_act,
)

__all__ = ["Act", "AdminError", "DrainResult", "EngineAdmin", "EngineObs", "EngineRecord",
           "Event", "Failure", "Phase", "Transaction", "admin_url", "advance", "choose_wave",
           "new_transaction", "next_act", "observe", "run"]
