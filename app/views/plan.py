"""Page script for st.navigation (see app/main.py)."""
from app.plan_page import plan_page

plan_page()
