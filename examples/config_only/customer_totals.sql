-- The complete new contents of customer_total, in its column order.
-- pgjobs stages this in an analyzed temp table (no row lock held while it
-- runs), then writes only the rows that differ.
select c.id as customer_id,
       count(o.id)::integer as orders,
       coalesce(sum(o.amount), 0)::numeric(12, 2) as amount
from customer c
left join orders o on o.customer_id = c.id
group by c.id
