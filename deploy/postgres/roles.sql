-- Least-privilege roles for the outbox's parts (docs/security.md, "Database roles"): the
-- migration job owns the schema; the publishers, the API and the writers (Spark jobs,
-- applications) read and write rows and create nothing, and none of them is a superuser.
--
-- psql variables: db (the outbox's database), and for each role its name and password:
--   owner / owner_password          migrations (`outbox migrate`): owns every table
--   publisher / publisher_password  `outbox publish`
--   api / api_password              `outbox serve`
--   writer / writer_password        the Spark writer and `enqueue` in applications
-- Run by a role that may create roles and owns the database (the image's superuser in
-- deploy/docker-compose.yml, through deploy/postgres/init-roles.sh):
--   psql -v ON_ERROR_STOP=1 -v db=outbox -v owner=outbox_owner -v owner_password=... -f roles.sql
-- The grants on tables are default privileges of the owner: tables a later migration adds
-- get them too.

CREATE ROLE :"owner" LOGIN PASSWORD :'owner_password';
CREATE ROLE :"publisher" LOGIN PASSWORD :'publisher_password';
CREATE ROLE :"api" LOGIN PASSWORD :'api_password';
CREATE ROLE :"writer" LOGIN PASSWORD :'writer_password';
-- ALTER DEFAULT PRIVILEGES FOR ROLE needs the running role to act as the owner
GRANT :"owner" TO CURRENT_USER;

-- only these roles connect; the Spark writer stages rows in a temporary table
REVOKE ALL ON DATABASE :"db" FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE :"db" TO :"owner", :"publisher", :"api", :"writer";

\connect :"db"
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO :"owner";
GRANT USAGE ON SCHEMA public TO :"publisher", :"api", :"writer";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"publisher", :"api", :"writer";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT USAGE, SELECT ON SEQUENCES TO :"publisher", :"api", :"writer";
