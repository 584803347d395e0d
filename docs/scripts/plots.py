def all_plots(): return {}
