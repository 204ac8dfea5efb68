"""Page script for st.navigation (see app/main.py)."""
from stagewise.app.plan_page import plan_page

plan_page()
